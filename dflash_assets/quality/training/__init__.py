"""The drafter training set: which rows pass, where each conversation ends, the held-out split, and the files the trainers read."""
