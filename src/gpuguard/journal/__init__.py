"""The journal: structured entries with a MESSAGE_ID per kind, the message catalog that
explains each, and lasting conditions journaled when they appear, change and clear."""
