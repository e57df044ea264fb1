"""hpcrl SQD scheduler.

Owns the program pool, runs Staged Quality-Diversity search, builds groups and rewards."""
