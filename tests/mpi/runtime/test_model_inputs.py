"""data.x=[input_ids,attention_mask] in real mpirun jobs: a PyTorch model of two inputs (ids and a
padding mask that its attention and its pooling read) exported to ONNX trains on padded rows as
PyTorch does (float64, to 1e-10) on 1 rank, and on 2 ranks with either cache, either
distribution, from one file, a directory and files of one sample each; exports back with its own inputs; a token
classifier's padded positions labelled -100 leave one mean over the global batch's labelled
tokens; a count, dtype or mask-length mismatch and a token id past the embedding are each one
error on every rank."""

from __future__ import annotations

import re
import subprocess
import warnings

import h5py
import numpy as np
import pytest

from tests.mpi.runtime.test_onnx_training import max_rel_diff, params_of
from tests.support.jobs import PYTHON, REPO, explain, mpi_env, mpirun, train_job

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
load_file = pytest.importorskip("safetensors.numpy").load_file
pytestmark = pytest.mark.mpi

N, TRAIN, T, VOCAB, CLASSES, STEPS, LR, WD = 40, 32, 6, 20, 3, 3, 0.01, 0.1
COMMON = ["model=onnx", "data=file", "train.dtype=float64", f"train.epochs={STEPS}", f"train.batch_size={TRAIN}",
          "data.val_fraction=0.2", "data.shuffle=false", "optim=adamw", f"optim.lr={LR}",
          f"optim.weight_decay={WD}", "optim.schedule=constant", "checkpoint=off", "report.tensorboard=false",
          "data.y=labels"]
IDS_MASK = "data.x=[input_ids,attention_mask]"


class MaskedAttentionClassifier(torch.nn.Module):
    """Embedding, one self-attention whose padded keys are masked out, a mean over the unpadded
    positions, a classifier. No weight is square, so a transposed one shows in its shape."""

    def __init__(self, per_token: bool = False):
        super().__init__()
        self.per_token = per_token      # logits for every position (B, T, C): a token classifier
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.q, self.k, self.v = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4), torch.nn.Linear(8, 5)
        self.head = torch.nn.Linear(5, CLASSES)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        m = attention_mask.to(h.dtype)
        scores = self.q(h) @ self.k(h).transpose(1, 2) / 2.0 + (1.0 - m[:, None, :]) * -1e4
        mixed = torch.softmax(scores, -1) @ self.v(h)
        if self.per_token:
            return self.head(mixed)
        return self.head((mixed * m[..., None]).sum(1) / m.sum(1, keepdim=True))


def _export(module, path):
    ids, mask = torch.zeros(2, T, dtype=torch.long), torch.ones(2, T, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (ids, mask), str(path), dynamo=False, input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamic_axes={n: {0: "batch"} for n in
                                                                 ("input_ids", "attention_mask", "logits")})
    return path


def _padded_rows(rng):
    """Rows of 2 to T tokens, padded with id 0 and mask 0 after their length."""
    lengths = rng.integers(2, T + 1, N)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1, VOCAB, (N, T)) * mask
    return ids.astype(np.int64), mask, rng.integers(0, CLASSES, N).astype(np.int64)


def _torch_reference(module, ids, mask, y) -> dict:
    """STEPS full-batch AdamW steps of the module in float64 on the training rows (per token:
    the classes on the last axis, the positions labelled -100 left out of the mean)."""
    module = module.double()
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    args = (torch.from_numpy(ids), torch.from_numpy(mask))
    for _ in range(STEPS):
        opt.zero_grad()
        logits = module(*args)
        logits = logits.transpose(1, 2) if logits.ndim == 3 else logits
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), ignore_index=-100).backward()
        opt.step()
    return {n: p.detach().numpy() for n, p in module.named_parameters()}


def _as_torch(got: dict, want: dict) -> dict:
    """model.h5's parameters (the import keeps the PyTorch names) as PyTorch holds them: a weight
    that the file keeps transposed for MatMul comes back transposed."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {k: v if v.shape == want[k].shape else v.T for k, v in got.items()}


def test_a_masked_two_input_model_trains_as_pytorch_on_one_and_two_ranks_in_every_data_mode(tmp_path):
    torch.manual_seed(0)
    module = MaskedAttentionClassifier()
    onnx_file = _export(module, tmp_path / "masked.onnx")
    ids, mask, y = _padded_rows(np.random.default_rng(0))
    data, parts = tmp_path / "d.h5", tmp_path / "parts"     # one file, and the same rows in a directory
    parts.mkdir()
    for path, (a, b) in [(data, (0, N)), (parts / "a.h5", (0, 13)), (parts / "b.h5", (13, N))]:
        with h5py.File(path, "w") as f:
            f["input_ids"], f["attention_mask"], f["labels"] = ids[a:b], mask[a:b], y[a:b]
    samples = tmp_path / "samples"       # one sample a file, without a sample axis
    samples.mkdir()
    for k in range(N):
        with h5py.File(samples / f"{k:03d}.h5", "w") as f:
            f["input_ids"], f["attention_mask"], f["labels"] = ids[k], mask[k], y[k]
    base = COMMON + [f"model.path={onnx_file}", f"data.path={data}"]
    # one rank names the inputs in the other order: each goes to the graph input of its name
    proc = train_job(1, tmp_path / "one", base + ["data.x=[attention_mask,input_ids]"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    want = _torch_reference(module, ids[:TRAIN], mask[:TRAIN], y[:TRAIN])
    one = params_of(tmp_path / "one")
    assert max_rel_diff(want, _as_torch(one, want)) <= 1e-10, max_rel_diff(want, _as_torch(one, want))
    # exported back: the file takes the model's own two inputs (checked in ONNX Runtime against
    # hpc_rlx on them), and the state dict holds the trained parameters under their PyTorch names
    out_onnx, out_sd = tmp_path / "trained.onnx", tmp_path / "trained.safetensors"
    cli = subprocess.run([PYTHON, "-m", "hpc_rlx.export", str(tmp_path / "one"), "--onnx", str(out_onnx),
                          "--state-dict", str(out_sd)], cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 0 and "checked in ONNX Runtime" in cli.stdout, explain(cli)
    assert [i.name for i in onnx.load(str(out_onnx)).graph.input] == ["input_ids", "attention_mask"]
    exported = {k: v.astype(np.float64) for k, v in load_file(str(out_sd)).items()}
    assert max_rel_diff(want, exported) <= 1e-6, max_rel_diff(want, exported)
    # two ranks, both caches, both distributions, the file and the directory: one launch, a
    # Hydra sweep of eight points
    sweep = tmp_path / "sweep"
    proc = mpirun(2, ["-m", "hpc_rlx", "-m", IDS_MASK, "data.cache=memory,stream", "data.distribution=read,scatter",
                      f"data.path={data},{parts}", f"hydra.sweep.dir={sweep}", "report.plots=false"]
                  + COMMON + [f"model.path={onnx_file}"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    points = {" ".join(o for o in (sweep / str(p) / "overrides.txt").read_text().split() if o.startswith("data.")
                       and "data.x" not in o): params_of(sweep / str(p)) for p in range(8)}
    assert len(points) == 8, sorted(points)
    proc = mpirun(2, ["-m", "hpc_rlx", "-m", IDS_MASK, "data.cache=memory,stream", f"data.path={samples}",
                      "data.one_sample_per_file=true", f"hydra.sweep.dir={tmp_path / 'samples_sweep'}",
                      "report.plots=false"] + COMMON + [f"model.path={onnx_file}"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    points.update({f"one sample a file {p}": params_of(tmp_path / "samples_sweep" / str(p)) for p in range(2)})
    for point, got in points.items():
        assert max_rel_diff(one, got) <= 1e-10, (point, max_rel_diff(one, got))


def test_padded_positions_labelled_minus_100_are_left_out_of_one_mean_over_the_global_batch(tmp_path):
    """A token classifier: the labels of padded positions are -100 (as transformers writes them)
    and model.ignore_index=-100; the two ranks' rows hold different numbers of labelled tokens,
    and the loss is the mean over all the labelled tokens of the global batch, as PyTorch's."""
    torch.manual_seed(0)
    module = MaskedAttentionClassifier(per_token=True)
    onnx_file = _export(module, tmp_path / "tokens.onnx")
    ids, mask, _ = _padded_rows(np.random.default_rng(2))
    labels = np.where(mask == 1, np.random.default_rng(3).integers(0, CLASSES, (N, T)), -100)
    per_rank = [int((labels[:TRAIN // 2] != -100).sum()), int((labels[TRAIN // 2:TRAIN] != -100).sum())]
    assert per_rank[0] != per_rank[1], per_rank       # a mean of the ranks' means would differ
    data = tmp_path / "tokens.h5"
    with h5py.File(data, "w") as f:
        f["input_ids"], f["attention_mask"], f["labels"] = ids, mask, labels.astype(np.int64)
    proc = train_job(2, tmp_path / "run", COMMON + [IDS_MASK, f"model.path={onnx_file}", f"data.path={data}",
                                                    "model.ignore_index=-100"],
                     timeout=120)
    assert proc.returncode == 0, explain(proc)
    want = _torch_reference(module, ids[:TRAIN], mask[:TRAIN], labels[:TRAIN])
    got = _as_torch(params_of(tmp_path / "run"), want)
    assert max_rel_diff(want, got) <= 1e-10, max_rel_diff(want, got)


def _past_vocabulary(ids):
    ids = ids.copy()
    ids[3, 2] = VOCAB
    return ids


BAD = {   # case -> (the file's datasets changed, overrides, the words of the one error)
    "count": ({}, ["data.x=[input_ids,attention_mask,token_type_ids]"],
              r"data\.x names 3 datasets .* the ONNX graph has 2 data inputs"),
    "dtype": ({"attention_mask": lambda m: m.astype(np.float64)}, [IDS_MASK],
              r"data\.x dataset 'attention_mask' holds float64, but the ONNX input 'attention_mask'"),
    "mask length": ({"attention_mask": lambda m: m[:, :T - 1]}, [IDS_MASK],
                    rf"data\.x dataset 'attention_mask' has rows of shape \({T - 1},\), but the ONNX input "
                    rf"'attention_mask' it feeds takes \({T},\)"),
    "token id": ({"input_ids": _past_vocabulary}, [IDS_MASK],
                 rf"input token id {VOCAB} at row 3 is outside the vocabulary \[0, {VOCAB}\) of the embedding "
                 r"'[^']*emb[^']*'"),
}


def test_inputs_that_do_not_fit_the_graph_are_one_error_on_every_rank(tmp_path):
    torch.manual_seed(0)
    onnx_file = _export(MaskedAttentionClassifier(), tmp_path / "masked.onnx")
    ids, mask, y = _padded_rows(np.random.default_rng(1))
    for case, (change, extra, message) in BAD.items():
        data = tmp_path / f"{case.replace(' ', '_')}.h5"
        datasets = {"input_ids": ids, "attention_mask": mask, "labels": y, "token_type_ids": np.zeros_like(ids)}
        with h5py.File(data, "w") as f:
            for name, value in datasets.items():
                f[name] = change[name](value) if name in change else value
        proc = train_job(2, tmp_path / case.replace(" ", "_"),
                         COMMON + [f"model.path={onnx_file}", f"data.path={data}"] + extra, timeout=60)
        assert proc.returncode == 2, (case, explain(proc))
        assert proc.stderr.count("hpc_rlx: error") == 1, (case, explain(proc))
        assert re.search(message, proc.stderr), (case, explain(proc))
