"""Precision plugins (fp32, fp16, bf16, amp; registered by :mod:`.plugin`) and the loss scalers they share."""
