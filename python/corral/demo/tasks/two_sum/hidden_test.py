import sys

from solution import two_sum

CASES = [
    (([2, 7, 11, 15], 9), (0, 1)),
    (([3, 2, 4], 6), (1, 2)),
    (([3, 3], 6), (0, 1)),
    (([1, 2, 3], 7), None),
    (([], 0), None),
    (([5, 1, 5, 1], 6), (0, 1)),
]


def main():
    for (nums, target), want in CASES:
        got = two_sum(list(nums), target)
        got = tuple(got) if got is not None else None
        if got != want:
            print(f"FAIL two_sum({nums!r}, {target}) = {got!r}, want {want!r}")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
