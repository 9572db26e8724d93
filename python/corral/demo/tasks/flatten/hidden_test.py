import sys

from solution import flatten

CASES = [
    ([], []),
    ([1, [2, 3], 4], [1, 2, 3, 4]),
    ([1, [2, [3, [4]]], 5], [1, 2, 3, 4, 5]),
    ([[[[]]], "ab", ["c", ["d"]]], ["ab", "c", "d"]),
]


def main():
    for given, want in CASES:
        got = flatten(given)
        if got != want:
            print(f"FAIL flatten({given!r}) = {got!r}, want {want!r}")
            return 1
    deep = [0]
    for i in range(1, 2000):
        deep = [deep, i]
    if flatten(deep) != list(range(2000)):
        print("FAIL flatten of a 2000-deep list")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
