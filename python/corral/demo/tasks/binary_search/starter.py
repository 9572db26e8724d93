def binary_search(items, x):
    """Index of x in the sorted list items, or -1."""
    raise NotImplementedError


if __name__ == "__main__":
    print(binary_search([1, 3, 5, 7], 5))
