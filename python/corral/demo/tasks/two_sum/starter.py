def two_sum(nums, target):
    """(i, j) with i < j and nums[i] + nums[j] == target, or None."""
    raise NotImplementedError


if __name__ == "__main__":
    print(two_sum([2, 7, 11, 15], 9))
