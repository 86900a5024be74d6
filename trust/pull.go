package trust

// Results of a verification (Decision.Verify).
const (
	// Accepted: the signatures the requirements want verified.
	Accepted = "accepted"
	// Unverified: the requirements accept the image without signatures.
	Unverified = "unverified"
	// Rejected: refused (a *Rejection).
	Rejected = "rejected"
	// FetchFailed: the signatures could not be fetched.
	FetchFailed = "error"
)

// Acceptance is the result of an image these requirements accept:
// Accepted when signatures were verified, Unverified when none are asked.
func (d *Decision) Acceptance() string {
	if d.Requirements.NeedsSignatures() {
		return Accepted
	}
	return Unverified
}

// Verify checks img for a pull: with kept, the signatures the node keeps
// for img's digest already, when they satisfy the requirements (a
// signature of a digest stays true: the registry need not be asked
// again), else with what fetch gets from the registry, which is called
// only when a requirement looks at signatures. It returns the signatures
// to keep beside the image (none new when kept sufficed), the result, and
// the refusal or fetch error.
func (d *Decision) Verify(img Image, kept []Signature, fetch func() ([]Signature, error)) ([]Signature, string, error) {
	if !d.Requirements.NeedsSignatures() {
		if err := d.Check(img, nil); err != nil {
			return nil, Rejected, err
		}
		return nil, Unverified, nil
	}
	if len(kept) > 0 && d.Check(img, kept) == nil {
		return nil, Accepted, nil
	}
	sigs, err := fetch()
	if err != nil {
		return nil, FetchFailed, err
	}
	if err := d.Check(img, sigs); err != nil {
		return nil, Rejected, err
	}
	return sigs, Accepted, nil
}
