def is_palindrome(s):
    """True if s is a palindrome, ignoring case and non-alphanumeric characters."""
    s = s.lower()  # bug: spaces and punctuation still count
    return s == s[::-1]


if __name__ == "__main__":
    print(is_palindrome("racecar"), is_palindrome("hello"))
