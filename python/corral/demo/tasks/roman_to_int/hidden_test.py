import sys

from solution import roman_to_int

CASES = [("I", 1), ("III", 3), ("IV", 4), ("IX", 9), ("LVIII", 58), ("XC", 90),
         ("CD", 400), ("MCMXCIV", 1994), ("MMMCMXCIX", 3999)]


def main():
    for s, want in CASES:
        got = roman_to_int(s)
        if got != want:
            print(f"FAIL roman_to_int({s!r}) = {got!r}, want {want!r}")
            return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
