"""Fold py-spy's raw (collapsed-stack) output into the functions that took the samples: self and inclusive
share of the samples whose stack holds a frame containing WITHIN (e.g. `LLM.generate`: the timed passes only),
top K each. Usage: python -m benchmarks.probes.fold_pyspy RAW [K] [WITHIN]"""
import collections


def fold(path: str, within: str = "") -> tuple[int, collections.Counter, collections.Counter]:
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or (within and within not in stack):
            continue
        k = int(n)
        total += k
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in stack.split(";")[1:]]
        if frames:
            self_c[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    return total, self_c, incl


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("Usage:")[0])
    ap.add_argument("raw", help="py-spy's raw output")
    ap.add_argument("k", nargs="?", type=int, default=30, help="frames listed per table")
    ap.add_argument("within", nargs="?", default="", help="only stacks through a frame holding this")
    a = ap.parse_args()
    k = a.k
    total, self_c, incl = fold(a.raw, a.within)
    print(f"{total} samples")
    for name, c in (("self", self_c), ("inclusive", incl)):
        print(f"-- {name}")
        for f, n in c.most_common(k):
            print(f"{100 * n / max(total, 1):6.1f}%  {f}")


if __name__ == "__main__":
    main()
