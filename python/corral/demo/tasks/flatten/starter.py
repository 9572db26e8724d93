def flatten(nested):
    """The non-list items of a nested list, in order."""
    raise NotImplementedError


if __name__ == "__main__":
    print(flatten([1, [2, 3], 4]))
