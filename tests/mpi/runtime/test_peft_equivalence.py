"""Fine-tuning a Hugging Face model as transformers and PEFT do, in real mpirun jobs: a small BERT
and a small GPT-2 sequence classifier, built from their config classes and "pretrained" by a few
PyTorch steps (so no parameter is at its initial value), exported by dynamo with two inputs
(input_ids, attention_mask), train on padded rows (BERT's padded on the right, GPT-2's on the
left) for 5 steps on 1 and on 2 ranks in float64. Each reference is PyTorch in float64 on the
batches hpc_rlx's plan gives (data.shuffle=false: the training samples are cut into one row per
batch slot and step s takes sample s of every row), to 1e-10:

- model.freeze (the embeddings), optim.no_decay (biases and LayerNorm weights, transformers'
  recipe) and optim.lr_mult (the head at 10x) together with AdamW equal torch.optim.AdamW with
  one parameter group per parameter and the frozen ones requires_grad=False; those stay bitwise
  what the file held.
- LoRA (r=4 on BERT's query and value, on GPT-2's Conv1D c_attn) with the head in
  model.train_only and SGD with momentum equals peft.get_peft_model (modules_to_save the head)
  started from the run's own initial adapters (hpc_rlx.graph.lora.initial_adapters); every base
  weight stays bitwise what the file held."""

from __future__ import annotations

import copy
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import pytest

from tests.mpi.runtime.test_onnx_training import max_rel_diff, params_of
from tests.support.jobs import explain, train_job

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")
peft = pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one worker holds the module's two exports; 8 jobs, two at a time: about 45 s on 2 busy cores
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.xdist_group("peft-equivalence")]

VOCAB, T, CLASSES, PAD = 40, 8, 3, 0
# Head dim 4: the import folds the attention scale's square root (applied to the queries and to
# the keys) from the file's float32 constant, so a float64 run meets PyTorch's float64 only where
# that root is exact or one the import recognises: sqrt(0.5) is; 8 ** -0.25 (head dim 8) is not,
# and scales every score by 1 + 6e-8
HIDDEN, HEADS = 16, 4
N, TRAIN, BATCH = 48, 40, 8          # 8 validation rows after the 40 training ones
STEPS = TRAIN // BATCH               # one epoch: each of the BATCH rows holds STEPS samples
# AdamW's eps well above the rounding noise of a gradient that is zero in exact arithmetic (an
# attention key's bias, ~1e-18), which eps=1e-8 would turn into steps of ~lr * 1e-10 that differ
# between any two implementations
LR, WD, ADAM_EPS, HEAD_MULT = 0.01, 0.1, 1e-6, 10.0
LORA_RANK, ALPHA, SGD_LR, MOMENTUM = 4, 6, 0.5, 0.9     # alpha/r = 1.5, not the default's 2
COMMON = ["model=onnx", "data=file", "data.x=[input_ids,attention_mask]", "data.y=labels",
          "data.val_fraction=0.1667", "data.shuffle=false", "train.dtype=float64", "train.epochs=1",
          f"train.batch_size={BATCH}", "optim.schedule=constant", "checkpoint=off", "report.tensorboard=false"]


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=32,
        max_position_embeddings=16, num_labels=CLASSES, pad_token_id=PAD, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _gpt2():
    # no key-value cache (an export cannot return it); the classifier pools at the last non-pad token
    return transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=HIDDEN, n_layer=2, n_head=HEADS, num_labels=CLASSES, pad_token_id=PAD,
        bos_token_id=1, eos_token_id=1, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


# name -> the model, its padding side, and which of its PyTorch names are the embeddings, the
# parameters transformers' recipe leaves undecayed, the head and the LoRA targets: globs for
# hpc_rlx, predicates and PEFT's LoraConfig for the reference
MODELS = {
    "bert": dict(build=_bert, padding="right", freeze="[bert.embeddings.*]",
                 no_decay="[*bias,*LayerNorm.weight]", lr_mult="{classifier.*:10}", lora="[*query,*value]",
                 peft=dict(target_modules=["query", "value"], modules_to_save=["classifier"]),
                 frozen=lambda n: n.startswith("bert.embeddings."),
                 undecayed=lambda n: n.endswith(".bias") or n.endswith("LayerNorm.weight"),
                 head=lambda n: n.startswith("classifier.")),
    "gpt2": dict(build=_gpt2, padding="left", freeze="[transformer.wte.*,transformer.wpe.*]",
                 no_decay="[*bias,*ln_*.weight]", lr_mult="{score.*:10}",
                 lora="[*c_attn]",    # a Conv1D, stored (in, out): PEFT's fan_in_fan_out
                 peft=dict(target_modules=["c_attn"], modules_to_save=["score"], fan_in_fan_out=True),
                 frozen=lambda n: n.startswith(("transformer.wte.", "transformer.wpe.")),
                 undecayed=lambda n: n.endswith(".bias") or ".ln_" in n,
                 head=lambda n: n.startswith("score.")),
}


def _padded_rows(rng):
    """Rows of 3 to T tokens (ids 2 and up), then pad id 0 and mask 0, as a tokenizer pads."""
    lengths = rng.integers(3, T + 1, N)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(2, VOCAB, (N, T)) * mask
    return ids.astype(np.int64), mask, rng.integers(0, CLASSES, N).astype(np.int64)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """side -> (an HDF5 file, input_ids, attention_mask, labels): the same padded rows padded on
    the right (BERT pools at the first token) and on the left (GPT-2 is causal: padded on the
    right, its tokens would never see the pads, and the mask would change nothing)."""
    ids, mask, y = _padded_rows(np.random.default_rng(0))
    assert len(set(mask.sum(1).tolist())) > 3          # rows of many lengths
    shift = T - mask.sum(1)
    left = np.array([np.roll(row, k) for row, k in zip(ids, shift)]), np.array([np.roll(row, k) for row, k in
                                                                               zip(mask, shift)])
    folder, sides = tmp_path_factory.mktemp("peft-data"), {}
    for side, (i, m) in {"right": (ids, mask), "left": left}.items():
        path = folder / f"padded-{side}.h5"
        with h5py.File(path, "w") as f:
            f["input_ids"], f["attention_mask"], f["labels"] = i, m, y
        sides[side] = (path, i, m, y)
    return sides


def _pretrain(module, ids, mask, y):
    """A few float32 AdamW steps (weight decay moves every parameter, the loss the rest)."""
    opt = torch.optim.AdamW(module.parameters(), lr=0.02, weight_decay=0.1)
    rng = np.random.default_rng(1)
    for _ in range(3):
        rows = rng.choice(len(y), 16, replace=False)
        opt.zero_grad()
        logits = module(input_ids=torch.from_numpy(ids[rows]), attention_mask=torch.from_numpy(mask[rows])).logits
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(y[rows])).backward()
        opt.step()


@pytest.fixture(scope="module", params=sorted(MODELS))
def pretrained(request, data, tmp_path_factory):
    """(name, the pretrained float32 module, its dynamo export with inputs input_ids and
    attention_mask, its padded rows as `data` gives them), shared by the tests of the module."""
    name = request.param
    rows = data[MODELS[name]["padding"]]
    _, ids, mask, y = rows
    torch.manual_seed(0)
    module = MODELS[name]["build"]().train()
    # biases start away from zero, as a pretrained model's are: an attention key's bias gets no
    # gradient (softmax ignores what adds the same to every key), only rounding noise, which a
    # comparison relative to a bias of zero would measure
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.02)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    _pretrain(module, ids, mask, y)
    unmoved = [n for n, p in module.named_parameters() if torch.equal(p.detach(), initial[n])]
    assert not unmoved, unmoved
    path = tmp_path_factory.mktemp(f"peft-{name}") / f"{name}.onnx"
    sample = (torch.from_numpy(ids[:2]),)     # GPT-2 takes the mask by keyword only
    # dynamo: the import refuses either model's TorchScript export ("Gather: dynamic shape (a
    # value that varies along the batch) cannot be made static")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, sample, str(path), kwargs={"attention_mask": torch.from_numpy(mask[:2])},
                          dynamo=True, optimize=False, verbose=False, input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamic_shapes={"input_ids": {0: torch.export.Dim("batch")},
                                                                   "attention_mask": {0: torch.export.Dim("batch")}})
    return name, module, path, rows


def plan_batches() -> list[list[int]]:
    """The training rows of each step as hpc_rlx's plan takes them with data.shuffle=false: the
    TRAIN samples cut into BATCH contiguous rows of STEPS, step s takes sample s of every row."""
    return [[row * STEPS + s for row in range(BATCH)] for s in range(STEPS)]


def torch_steps(module, opt, data) -> dict:
    """STEPS cross-entropy steps of `opt` on `module` over the plan's batches; its parameters."""
    _, ids, mask, y = data
    for rows in plan_batches():
        opt.zero_grad()
        logits = module(input_ids=torch.from_numpy(ids[rows]), attention_mask=torch.from_numpy(mask[rows])).logits
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(y[rows])).backward()
        opt.step()
    return {n: p.detach().numpy() for n, p in module.named_parameters()}


def _as_torch(got: dict, want: dict) -> dict:
    """model.h5's parameters (the import keeps the PyTorch names) in PyTorch's layout."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return {k: v if v.shape == want[k].shape else v.T for k, v in got.items()}


def _worst(want: dict, got: dict) -> list:
    """The parameters furthest from PyTorch, by relative difference (for a failure's message)."""
    return sorted(((max_rel_diff({k: want[k]}, {k: got[k]}), k) for k in want), reverse=True)[:3]


def _train(tmp_path, name: str, overrides: list[str]) -> dict:
    """model.h5 of a 1-rank and of a 2-rank job with these overrides, run side by side (three
    ranks on two cores: most of a job this small is its start-up)."""
    runs = {ranks: tmp_path / f"{name}-{ranks}" for ranks in (1, 2)}
    with ThreadPoolExecutor(2) as pool:
        jobs = {ranks: pool.submit(train_job, ranks, run, COMMON + overrides, 120) for ranks, run in runs.items()}
    for ranks, job in jobs.items():
        proc = job.result()
        assert proc.returncode == 0, f"{ranks} rank(s): " + explain(proc)
    return {ranks: params_of(run) for ranks, run in runs.items()}


def test_freeze_no_decay_and_lr_mult_with_adamw_equal_torch_param_groups_on_padded_batches(tmp_path, pretrained):
    name, module, onnx_file, data = pretrained
    spec = MODELS[name]
    runs = _train(tmp_path, name, [
        f"model.path={onnx_file}", f"data.path={data[0]}", "optim=adamw", f"optim.lr={LR}", f"optim.eps={ADAM_EPS}",
        f"optim.weight_decay={WD}", f"model.freeze={spec['freeze']}", f"optim.no_decay={spec['no_decay']}",
        f"optim.lr_mult={spec['lr_mult']}"])

    reference = copy.deepcopy(module).double()
    initial = {n: p.detach().numpy().copy() for n, p in reference.named_parameters()}
    groups = []
    for n, p in reference.named_parameters():
        p.requires_grad_(not spec["frozen"](n))
        if p.requires_grad:
            groups.append({"params": [p], "lr": LR * (HEAD_MULT if spec["head"](n) else 1.0),
                           "weight_decay": 0.0 if spec["undecayed"](n) else WD})
    want = torch_steps(reference, torch.optim.AdamW(groups, lr=LR, eps=ADAM_EPS), data)

    frozen = [n for n in want if spec["frozen"](n)]
    assert frozen and len(frozen) < len(want)
    for ranks, params in runs.items():
        got = _as_torch(params, want)
        assert max_rel_diff(want, got) <= 1e-10, (ranks, _worst(want, got))
        for n in want:        # the frozen ones bit for bit as the file held them, the others moved
            assert np.array_equal(got[n], initial[n]) == spec["frozen"](n), (ranks, n)


def _peft_names(ir_name: str) -> str:
    """PEFT's state-dict key of an adapter the run names `<weight>.lora_A` (or `_B`)."""
    weight, which = ir_name.rsplit(".", 1)
    return f"base_model.model.{weight.removesuffix('.weight')}.{which}.default.weight"


def test_lora_with_a_trained_head_equals_peft_from_the_same_initial_adapters(tmp_path, pretrained):
    name, module, onnx_file, data = pretrained
    spec = MODELS[name]
    head = spec["peft"]["modules_to_save"][0]
    runs = _train(tmp_path, f"{name}-lora", [
        f"model.path={onnx_file}", f"data.path={data[0]}", f"model.lora.rank={LORA_RANK}", f"model.lora.alpha={ALPHA}",
        "model.lora.dropout=0", f"model.lora.targets={spec['lora']}", f"model.train_only=[{head}.*]", "optim=sgd",
        f"optim.lr={SGD_LR}", f"optim.momentum={MOMENTUM}"])
    from hpc_rlx.graph import Graph
    from hpc_rlx.graph.lora import initial_adapters
    graph = Graph.from_dict(json.loads((tmp_path / f"{name}-lora-1" / "graph.json").read_text()))
    initial = initial_adapters(graph, 0)                      # train.seed's draw, as the run made it
    assert len(initial) == 2 * 2 * len(spec["peft"]["target_modules"]), sorted(initial)

    reference = peft.get_peft_model(copy.deepcopy(module).double(), peft.LoraConfig(
        r=LORA_RANK, lora_alpha=ALPHA, lora_dropout=0.0, **spec["peft"]))
    state = dict(reference.named_parameters())
    with torch.no_grad():
        for ir_name, value in initial.items():
            state[_peft_names(ir_name)].copy_(torch.from_numpy(value))
    trained = [n for n, p in reference.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=SGD_LR, momentum=MOMENTUM)
    after = torch_steps(reference, opt, data)
    want = {ir_name: after[_peft_names(ir_name)] for ir_name in initial}
    want |= {n.replace(f"base_model.model.{head}.modules_to_save.default.", f"{head}."): after[n]
             for n in trained if ".modules_to_save." in n}
    assert len(want) == len(trained), (sorted(want), trained)        # the adapters and the head, nothing else

    base = {n: p.detach().double().numpy() for n, p in module.named_parameters()}
    for ranks, params in runs.items():
        got = {k: params[k] if params[k].shape == want[k].shape else params[k].T for k in want}
        assert max_rel_diff(want, got) <= 1e-10, (ranks, _worst(want, got))
        for k in initial:                     # every adapter moved from where it started
            assert not np.array_equal(params[k], initial[k]), (ranks, k)
        assert set(params) == set(base) | set(initial), sorted(set(params) ^ (set(base) | set(initial)))
        for k in set(base) - set(want):       # the base: bit for bit what the file held
            value = params[k] if params[k].shape == base[k].shape else params[k].T
            assert np.array_equal(value, base[k]), (ranks, k)
