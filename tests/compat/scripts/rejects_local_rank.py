"""A script whose parser does not accept --local_rank (torchrun style)."""
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
print("parsed", parser.parse_args())
