def word_counts(text):
    """Map each lowercase word (a run of ASCII letters) to its number of occurrences."""
    raise NotImplementedError


if __name__ == "__main__":
    print(word_counts("the cat and the hat"))
