import sys

from solution import balanced

CASES = [("", True), ("()", True), ("a(b[c]{d})", True), ("([)]", False), ("(]", False),
         ("((", False), ("))((", False), ("{[()()]}", True), ("}", False), ("x", True)]


def main():
    for s, want in CASES:
        got = balanced(s)
        if got is not want:
            print(f"FAIL balanced({s!r}) = {got!r}, want {want!r}")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
