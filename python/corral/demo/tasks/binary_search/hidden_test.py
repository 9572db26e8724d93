import sys

from solution import binary_search


def main():
    for n in range(0, 40):
        items = [3 * i + 1 for i in range(n)]
        for i, x in enumerate(items):
            if binary_search(items, x) != i:
                print(f"FAIL binary_search(<{n} items>, {x}) != {i}")
                return 1
        for x in (0, 2, 3 * n + 1, -5):
            if binary_search(items, x) != -1:
                print(f"FAIL binary_search(<{n} items>, {x}) should be -1")
                return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
