def roman_to_int(s):
    """The integer value of the Roman numeral s."""
    raise NotImplementedError


if __name__ == "__main__":
    print(roman_to_int("XIV"))
