"""Precision plugins (fp32, fp16, bf16, amp) and the loss scaler they share."""
