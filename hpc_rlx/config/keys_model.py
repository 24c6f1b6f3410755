"""The `model.*` keys (see `config/schema.py` for what a declaration is)."""

from __future__ import annotations

from hpc_rlx.base.checks import Check, OneOf, integer, number
from hpc_rlx.config.key import MODELS, Key, Options, every, selector

BUILT = ("mlp", "cnn", "transformer_lm")
_NUMBER = (int, float)
_PROBABILITY = Check(lambda v: v is not None and not isinstance(v, bool) and isinstance(v, (int, float))
                     and 0 <= v < 1, "must be a probability in [0, 1)")
_GLOBS = Check(lambda v: v is None or (isinstance(v, list) and all(isinstance(g, str) and g for g in v)),
               "must be a list of parameter-name globs")

MODEL_KEYS: tuple[Key, ...] = (
    selector("model", "name", MODELS),
    Key("model.hidden", (list, int), Options(mlp=[128, 128], cnn=64), "hidden widths (mlp), "
        "the dense layer's width (cnn)"),
    Key("model.activation", str, Options(mlp="relu"), "`relu`, `gelu`, `tanh` or `sigmoid`"),
    Key("model.channels", list, Options(cnn=[16, 32]), "convolution channels per block"),
    Key("model.kernel", int, Options(cnn=3), "convolution kernel size"),
    Key("model.pool", str, Options(cnn="max"), "`max` or `avg` pooling"),
    Key("model.d_model", int, Options(transformer_lm=64), "transformer width"),
    Key("model.n_heads", int, Options(transformer_lm=4), "attention heads"),
    Key("model.n_layers", int, Options(transformer_lm=2), "transformer blocks"),
    Key("model.d_ff", int, Options(transformer_lm=256), "feed-forward width"),
    Key("model.dropout", _NUMBER, every(BUILT, 0.0), "dropout probability"),
    Key("model.num_classes", int, every(BUILT, None), "classes (vocabulary for the LM); null = the "
        "file's or label dataset's `num_classes`/`vocab_size` attribute, else the training labels' "
        "largest value + 1"),
    Key("model.path", str, Options(graph="???", onnx="???"), "the graph JSON file (`graph`) or ONNX "
        "file (`onnx`; see docs/pytorch.md)"),
    Key("model.loss", str, Options(onnx="auto"), "`auto` (cross-entropy for integer labels, MSE for "
        "float targets, or the file's own scalar loss), `cross_entropy` or `mse`",
        OneOf("auto", "cross_entropy", "mse")),
    Key("model.sync_batch_norm", bool, Options(graph=False, onnx=False), "batch norm's statistics over "
        "the global batch (every rank and lane, per micro-batch), as PyTorch's `SyncBatchNorm`; false: "
        "each lane's own (docs/pytorch.md, \"Batch norm over the global batch\")"),
    Key("model.class_weights", list, every(MODELS, None), "one weight per class: a weighted "
        "cross-entropy, normalized as PyTorch's `weight=` with `reduction=\"mean\"`; null = equal "
        "(docs/data.md, \"Dense targets\")"),
    Key("model.ignore_index", int, every(MODELS, None), "a label (e.g. 255 or -100) left out of the "
        "loss and the metrics; null = none"),
    Key("model.class_axis", int, Options(onnx=None), "the class axis of a cross-entropy's logits "
        "where the shapes fit both: `1` ((B, C, *S)) or `-1` ((B, *S, C)); null = from the shapes",
        OneOf(None, 1, -1)),
    Key("model.init_from", str, every(MODELS, None), "HDF5 file of initial parameters (e.g. a "
        "previous run's `model.h5`)"),
    Key("model.freeze", list, every(MODELS, []), "parameter-name globs (PyTorch names for `model=onnx`, "
        "the `model.h5` names otherwise) of parameters that do not train: no gradient, no optimizer state, "
        "no place in the bucket; batch-norm running statistics still update (docs/pytorch.md, \"Frozen "
        "parameters\")", _GLOBS),
    Key("model.train_only", list, every(MODELS, []), "parameter-name globs of the only parameters that "
        "train: every other one is frozen as by `model.freeze` (not both)", _GLOBS),
    # LoRA adapters (graph/lora.py; docs/finetuning.md): the schema's nested keys, `model.lora.*`
    Key("model.lora.rank", int, every(MODELS, 0), "LoRA rank r: each `model.lora.targets` weight W "
        "trains as W + (alpha/r)·B·A with A (r, in) and B (out, r) while W and every other base "
        "parameter stay frozen; 0 = off", integer(0)),
    Key("model.lora.alpha", _NUMBER, every(MODELS, 8), "LoRA scale numerator: the update is "
        "(alpha/r)·B·A, as PEFT's `lora_alpha`", number(0, above=True, must="must be a number > 0")),
    Key("model.lora.dropout", _NUMBER, every(MODELS, 0.0), "dropout on the adapters' input only, as "
        "PEFT's `lora_dropout` (not `model.dropout`, the builders' dropout)", _PROBABILITY),
    Key("model.lora.targets", list, every(MODELS, []), "globs of the weights that get adapters, matched "
        "against a weight's name or its module's (the name without `.weight`), e.g. `[*query,*value]`; "
        "2-D weights read by MatMul/Gemm only", _GLOBS),
)
