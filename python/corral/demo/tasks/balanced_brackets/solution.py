PAIRS = {")": "(", "]": "[", "}": "{"}


def balanced(s):
    """True if the brackets ()[]{} in s are balanced and properly nested."""
    stack = []
    for ch in s:
        if ch in "([{":
            stack.append(ch)
        elif ch in PAIRS:
            if not stack or stack.pop() != PAIRS[ch]:
                return False
    return not stack


if __name__ == "__main__":
    print(balanced("(a[b]c)"), balanced("(]"))
