def fizzbuzz(n):
    """Return ["1", "2", "Fizz", ...] for 1..n."""
    raise NotImplementedError


if __name__ == "__main__":
    print(fizzbuzz(15))
