"""`swaserve bench memory` (`main.py`): the model of admission (`admission.py`) and its report."""
