def balanced(s):
    """True if the brackets ()[]{} in s are balanced and properly nested."""
    raise NotImplementedError


if __name__ == "__main__":
    print(balanced("(a[b]c)"), balanced("(]"))
