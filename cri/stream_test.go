package cri

import (
	"errors"
	"slices"
	"testing"
)

func TestSendInBatches(t *testing.T) {
	for _, n := range []int{0, 1, streamBatch, streamBatch + 1, 3*streamBatch + 7} {
		items := make([]int, n)
		for i := range items {
			items[i] = i
		}
		var got []int
		msgs := 0
		if err := sendInBatches(items, func(b []int) error {
			if len(b) == 0 || len(b) > streamBatch {
				t.Errorf("%d items: a message of %d", n, len(b))
			}
			msgs++
			got = append(got, b...)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, items) || msgs != (n+streamBatch-1)/streamBatch {
			t.Errorf("%d items: got %d in %d messages", n, len(got), msgs)
		}
	}
	boom := errors.New("client gone")
	calls := 0
	if err := sendInBatches(make([]int, 3*streamBatch), func([]int) error { calls++; return boom }); err != boom || calls != 1 {
		t.Errorf("a failed send: %v after %d calls", err, calls)
	}
}
