"""Submissions, futures and the retirer: work in flight keeps what it uses."""
