def two_sum(nums, target):
    """(i, j) with i < j and nums[i] + nums[j] == target, or None."""
    index = {x: i for i, x in enumerate(nums)}
    for i, x in enumerate(nums):
        if target - x in index:  # bug: may pair an element with itself
            return (i, index[target - x])
    return None


if __name__ == "__main__":
    print(two_sum([2, 7, 11, 15], 9))
