"""The flood profile's summary: python benchmarks/results/<this folder>/summarize_profile.py <this folder> (from the repository root, PYTHONPATH=.)."""
import gzip, sys
from benchmarks.api_profile import parse_raw, per_function, by_package
d = sys.argv[1]
for name in ("engine", "api"):
    stacks = parse_raw(gzip.open(f"{d}/flood_{name}.collapsed.gz", "rt").read())
    total = sum(stacks.values())
    print(f"== {name}: {total} samples (py-spy, 200/s, 40 s, running threads only)")
    print("-- by package (innermost non-stdlib frame)")
    for p, n in by_package(stacks).most_common(8):
        print(f"  {n:5d} {100*n/total:5.1f}%  {p}")
    inclusive, own = per_function(stacks)
    print("-- inclusive, hotwire functions")
    for f, n in [(f, n) for f, n in inclusive.most_common() if "hotwire" in f][:16]:
        print(f"  {n:5d} {100*n/total:5.1f}%  {f}")
    print("-- inclusive, all functions (top 25)")
    for f, n in inclusive.most_common(25):
        print(f"  {n:5d} {100*n/total:5.1f}%  {f}")
