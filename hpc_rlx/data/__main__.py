"""Dataset command line.

Examples::

    python -m hpc_rlx.data prepare digits --out data/digits.h5
    python -m hpc_rlx.data prepare synthetic --out data/syn.h5 --samples 1000000 --features 64
    python -m hpc_rlx.data prepare text --out data/text.h5 --seq-len 128
    python -m hpc_rlx.data info data/digits.h5
"""

from __future__ import annotations

import argparse
import sys

from hpc_rlx.errors import HpcRlxError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_rlx.data", description="Prepare or inspect HDF5 datasets.")
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("prepare", help="write a dataset (atomically replacing --out)")
    pr.add_argument("kind", choices=["digits", "synthetic", "text"])
    pr.add_argument("--out", required=True, help="output HDF5 path")
    # options default to None so that only the ones given are passed on; the recipe rejects
    # options that do not apply to the kind
    pr.add_argument("--seed", type=int, help="shuffle/generation seed (digits, synthetic)")
    pr.add_argument("--samples", type=int, help="number of rows (synthetic)")
    pr.add_argument("--features", type=int, help="input width (synthetic)")
    pr.add_argument("--classes", type=int, help="number of classes (synthetic)")
    pr.add_argument("--separation", type=float, help="mean distance between class centers in noise std (synthetic)")
    pr.add_argument("--seq-len", dest="seq_len", type=int, help="tokens per row (text)")

    info = sub.add_parser("info", help="print shapes, dtypes and attributes of a dataset")
    info.add_argument("path")
    info.add_argument("--x-name", default="x")
    info.add_argument("--y-name", default="y")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            from hpc_rlx.data.hdf5 import describe
            from hpc_rlx.data.prepare import prepare

            opts = {
                k: getattr(args, k)
                for k in ("seed", "samples", "features", "classes", "separation", "seq_len")
                if getattr(args, k) is not None
            }
            path = prepare(args.kind, args.out, **opts)
            info = describe(path)
            print(
                f"wrote {path}: {info.n} rows, x {info.x_shape} {info.x_dtype}, "
                f"y {info.y_shape} {info.y_dtype}, num_classes={info.attrs.get('num_classes')}"
            )
        else:
            from hpc_rlx.data.hdf5 import describe

            info = describe(args.path, args.x_name, args.y_name)
            print(f"path: {info.path}")
            print(f"rows: {info.n}")
            print(f"{info.x_name}: per-sample shape {info.x_shape}, dtype {info.x_dtype}")
            print(f"{info.y_name}: per-sample shape {info.y_shape}, dtype {info.y_dtype}")
            for k in sorted(info.attrs):
                v = info.attrs[k]
                print(f"attr {k}: {v!r}" if k != "vocab_codepoints" else f"attr {k}: <{len(v)} code points>")
    except HpcRlxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
