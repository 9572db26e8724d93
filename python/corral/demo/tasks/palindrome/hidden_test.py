import sys

from solution import is_palindrome

CASES = [
    ("", True), ("a", True), ("racecar", True), ("hello", False), ("Abba", True),
    ("A man, a plan, a canal: Panama", True), ("No 'x' in Nixon", True),
    ("race a car", False), ("12321", True), ("123 21", True), ("ab", False),
]


def main():
    for s, want in CASES:
        got = is_palindrome(s)
        if got is not want:
            print(f"FAIL is_palindrome({s!r}) = {got!r}, want {want!r}")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
