import re


def word_counts(text):
    """Map each lowercase word (a run of ASCII letters) to its number of occurrences."""
    counts = {}
    for word in re.findall(r"[a-z]+", text.lower()):
        counts[word] = counts.get(word, 0) + 1
    return counts


if __name__ == "__main__":
    print(word_counts("the cat and the hat"))
