def is_palindrome(s):
    """True if s is a palindrome, ignoring case and non-alphanumeric characters."""
    raise NotImplementedError


if __name__ == "__main__":
    print(is_palindrome("racecar"), is_palindrome("hello"))
