def balanced(s):
    """True if the brackets ()[]{} in s are balanced and properly nested."""
    # bug: counts each kind separately, so interleavings like "([)]" pass
    return all(s.count(o) == s.count(c) for o, c in ("()", "[]", "{}"))


if __name__ == "__main__":
    print(balanced("(a[b]c)"), balanced("(]"))
