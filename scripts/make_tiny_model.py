"""Create a tiny random-weight model as a real Hugging Face directory (no network).

python scripts/make_tiny_model.py OUT_DIR [--arch ARCH] [--seed 0]    # ARCH: see --help (llama, qwen3_moe, gemma3, ...)
"""

import argparse

from batchjob.job.tiny_model import ARCHITECTURES, make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed))


if __name__ == "__main__":
    main()
