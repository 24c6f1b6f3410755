"""Dataset command line.

Examples::

    python -m hpc_rlx.data prepare digits --out data/digits.h5
    python -m hpc_rlx.data prepare synthetic --out data/syn.h5 --samples 1000000 --features 64
    python -m hpc_rlx.data prepare text --out data/text.h5 --seq-len 128
    python -m hpc_rlx.data convert my.csv --label target --out data/my.h5
    python -m hpc_rlx.data convert my.npz --label y --out data/my.h5     # the other array is x
    python -m hpc_rlx.data info data/digits.h5
    python -m hpc_rlx.data info 'shards/*.h5'      (a directory or a glob: the files as one set)
"""

from __future__ import annotations

import argparse
import sys

from hpc_rlx.base.errors import HpcRlxError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_rlx.data",
                                description="Prepare, convert or inspect HDF5 datasets.")
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

    cv = sub.add_parser("convert", help="turn a CSV or .npz file into hpc_rlx's HDF5 layout",
                        description="Write a CSV (header row of column names, or none) or a NumPy "
                                    ".npz archive as the x/y HDF5 file hpc_rlx trains on (chunked, "
                                    "compressed). Labels that are whole numbers become int64 class "
                                    "indices; others are float regression targets.")
    cv.add_argument("input", help="FILE.csv, .tsv, .txt or .npz")
    cv.add_argument("--label", required=True,
                    help="CSV: the label column (header name, or 0-based number); .npz: the array of labels")
    cv.add_argument("--out", required=True, help="output HDF5 path")
    cv.add_argument("--x", help=".npz: the array of inputs (default: the one array besides --label)")
    cv.add_argument("--force", action="store_true", help="replace --out if it exists")
    cv.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="dtype of float inputs (default float32)")
    cv.add_argument("--regression", action="store_true",
                    help="keep labels as float targets even when they are whole numbers")
    cv.add_argument("--num-classes", dest="num_classes", type=int,
                    help="number of classes (default: largest label + 1)")
    cv.add_argument("--delimiter", help="CSV field delimiter (default: guessed from the first line)")

    info = sub.add_parser("info", help="print shapes, dtypes and attributes of a dataset (a file, a "
                                       "directory of files or a glob pattern)")
    info.add_argument("path")
    info.add_argument("--x-name", default="x")
    info.add_argument("--y-name", default="y")
    info.add_argument("--one-sample-per-file", action="store_true",
                      help="each file holds one sample without a sample axis (data.one_sample_per_file)")
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
        elif args.command == "convert":
            from hpc_rlx.data.convert import convert

            done = convert(args.input, args.out, args.label, x=args.x, force=args.force,
                           dtype=args.dtype, regression=args.regression,
                           delimiter=args.delimiter, num_classes=args.num_classes)
            print(done.describe())
        else:
            from hpc_rlx.data.files import check_files, describe_set, meta_of

            info, files = describe_set(args.path, args.x_name, args.y_name, args.one_sample_per_file)
            if files.one_sample:      # the others were checked as their counts were read
                check_files(files, range(1, len(files)), args.x_name, args.y_name, meta_of(info), files.paths[0])
            print(f"path: {info.path}")
            if len(files) > 1 or files.one_sample:
                print(f"files: {len(files)} ({files.paths[0]} ... {files.paths[-1]})"
                      + (", one sample each" if files.one_sample else ""))
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
