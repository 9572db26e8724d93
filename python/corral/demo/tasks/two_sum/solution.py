def two_sum(nums, target):
    """(i, j) with i < j and nums[i] + nums[j] == target, or None."""
    seen = {}
    for j, x in enumerate(nums):
        if target - x in seen:
            return (seen[target - x], j)
        seen.setdefault(x, j)
    return None


if __name__ == "__main__":
    print(two_sum([2, 7, 11, 15], 9))
