"""Main job entry point (launched by run_megatron.sh through torchrun). Placeholder smoke job until the demo lands."""

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(f"megatron_rl smoke: rank {os.environ.get('RANK', '0')} config={args.config} overrides={args.overrides}")


if __name__ == "__main__":
    main()
