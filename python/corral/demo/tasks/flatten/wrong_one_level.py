def flatten(nested):
    """The non-list items of a nested list, in order."""
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(item)  # bug: only one level deep
        else:
            out.append(item)
    return out


if __name__ == "__main__":
    print(flatten([1, [2, 3], 4]))
