def flatten(nested):
    """The non-list items of a nested list, in order."""
    out = []
    stack = [iter(nested)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


if __name__ == "__main__":
    print(flatten([1, [2, 3], 4]))
