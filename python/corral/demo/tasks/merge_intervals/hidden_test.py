import sys

from solution import merge_intervals

CASES = [
    ([], []),
    ([[1, 3], [2, 6], [8, 10]], [[1, 6], [8, 10]]),
    ([[8, 10], [1, 3], [2, 6]], [[1, 6], [8, 10]]),
    ([[1, 3], [3, 5]], [[1, 5]]),
    ([[5, 7], [1, 2], [1, 10]], [[1, 10]]),
    ([[4, 4], [1, 1]], [[1, 1], [4, 4]]),
]


def main():
    for given, want in CASES:
        got = merge_intervals([list(x) for x in given])
        got = [list(x) for x in got]
        if got != want:
            print(f"FAIL merge_intervals({given!r}) = {got!r}, want {want!r}")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
