import sys

from solution import caesar

CASES = [
    (("abc", 1), "bcd"),
    (("xyz", 3), "abc"),
    (("Hello, World!", 3), "Khoor, Zruog!"),
    (("Khoor, Zruog!", -3), "Hello, World!"),
    (("Zebra", 52 + 1), "Afcsb"),
    (("é 9 _", 5), "é 9 _"),
]


def main():
    for (text, shift), want in CASES:
        got = caesar(text, shift)
        if got != want:
            print(f"FAIL caesar({text!r}, {shift}) = {got!r}, want {want!r}")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
