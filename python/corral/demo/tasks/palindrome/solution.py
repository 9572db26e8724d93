def is_palindrome(s):
    """True if s is a palindrome, ignoring case and non-alphanumeric characters."""
    kept = [c.lower() for c in s if c.isalnum()]
    return kept == kept[::-1]


if __name__ == "__main__":
    print(is_palindrome("racecar"), is_palindrome("hello"))
