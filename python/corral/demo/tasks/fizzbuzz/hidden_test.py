import sys

from solution import fizzbuzz

CASES = [
    (0, []),
    (1, ["1"]),
    (5, ["1", "2", "Fizz", "4", "Buzz"]),
    (15, ["1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz", "11", "Fizz", "13",
          "14", "FizzBuzz"]),
]


def main():
    for n, want in CASES:
        got = fizzbuzz(n)
        if got != want:
            print(f"FAIL fizzbuzz({n}) = {got!r}, want {want!r}")
            return 1
    got = fizzbuzz(100)
    if len(got) != 100 or got[29] != "FizzBuzz" or got[99] != "Buzz":
        print("FAIL fizzbuzz(100)")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
