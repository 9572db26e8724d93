def merge_intervals(intervals):
    """Merge overlapping or touching [start, end] intervals; return them sorted."""
    raise NotImplementedError


if __name__ == "__main__":
    print(merge_intervals([[1, 3], [2, 6], [8, 10]]))
