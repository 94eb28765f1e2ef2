"""Fold py-spy's raw (collapsed-stack) output into the functions that took the samples: self and inclusive
share of the samples whose stack holds a frame containing WITHIN (e.g. `LLM.generate`: the timed passes only),
top K each. Usage: python benchmarks/probes/fold_pyspy.py RAW [K] [WITHIN]"""
import collections
import sys


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
    path = sys.argv[1]
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    total, self_c, incl = fold(path, sys.argv[3] if len(sys.argv) > 3 else "")
    print(f"{total} samples")
    for name, c in (("self", self_c), ("inclusive", incl)):
        print(f"-- {name}")
        for f, n in c.most_common(k):
            print(f"{100 * n / max(total, 1):6.1f}%  {f}")


if __name__ == "__main__":
    main()
