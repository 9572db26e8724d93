def caesar(text, shift):
    """Shift each ASCII letter of text by shift places, wrapping, keeping case."""
    raise NotImplementedError


if __name__ == "__main__":
    print(caesar("abc", 1))
