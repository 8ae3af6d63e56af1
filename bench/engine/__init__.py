"""`swaserve bench engine` (`main.py`): the model both sides load (`model.py`), the two sides (`sides.py`), the measurement (`measure.py`) and its report."""
