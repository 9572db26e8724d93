import sys

from solution import word_counts

CASES = [
    ("", {}),
    ("the cat and the hat", {"the": 2, "cat": 1, "and": 1, "hat": 1}),
    ("The cat; the hat.", {"the": 2, "cat": 1, "hat": 1}),
    ("Hello, hello... HELLO!", {"hello": 3}),
    ("x1y 22 z", {"x": 1, "y": 1, "z": 1}),
]


def main():
    for text, want in CASES:
        got = word_counts(text)
        if got != want:
            print(f"FAIL word_counts({text!r}) = {got!r}, want {want!r}")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
