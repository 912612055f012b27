"""Tree drafts (docs/tree_drafts.md): several candidates per MTP depth, verified in one trunk pass.

    drafts.py   the tree's shape (TreeSpec), drafting it, verifying it, accepting a path, committing it
    ranks.py    which candidate ranks get accepted how often (what a tree's shape should follow)
"""
