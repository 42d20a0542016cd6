"""The tiny transformer the tests share: small enough for 8 ranks on 2 cores, large enough
that every split is real (16 model dims over tp 2 or 4, 8 positions over cp 2 or 4, a
16-token vocabulary over the vocabulary-parallel head). A test that needs another size
says which, e.g. `dict(GPT, heads=2)`."""

GPT = dict(model="gpt", layers=2, d_model=16, heads=4, seq_len=8, vocab=16, batch=8, steps=2,
           d_ff=32)
