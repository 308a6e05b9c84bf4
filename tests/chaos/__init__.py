"""The reliability (chaos) suite: fault injection against real worker processes."""
