package trust

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
)

// RekorKey is the public key of a Rekor transparency log, which signs the
// signed entry timestamps (SETs) of the entries it logs.
type RekorKey struct {
	// Name is where the key came from: a file, or
	// "rekorPublicKeyData[i]".
	Name string
	Key  *ecdsa.PublicKey
	// LogID is the log's ID, as SETs name it: the hex SHA-256 of the
	// key's DER (PKIX).
	LogID string
}

// parseRekorKey parses the PEM public key of a Rekor log.
func parseRekorKey(name string, pemBytes []byte) (RekorKey, error) {
	pub, err := cryptoutils.UnmarshalPEMToPublicKey(pemBytes)
	if err != nil {
		return RekorKey{}, fmt.Errorf("not a PEM public key: %w", err)
	}
	k, ok := pub.(*ecdsa.PublicKey)
	if !ok {
		return RekorKey{}, fmt.Errorf("not an ECDSA key (a %T), as Rekor's keys are", pub)
	}
	der, err := cryptoutils.MarshalPublicKeyToDER(k)
	if err != nil {
		return RekorKey{}, fmt.Errorf("unusable public key: %w", err)
	}
	id := sha256.Sum256(der)
	return RekorKey{Name: name, Key: k, LogID: hex.EncodeToString(id[:])}, nil
}

// rekorBundle is cosign's dev.sigstore.cosign/bundle annotation.
type rekorBundle struct {
	// SignedEntryTimestamp is the log's signature of the canonical JSON
	// of Payload.
	SignedEntryTimestamp []byte          `json:"SignedEntryTimestamp"`
	Payload              json.RawMessage `json:"Payload"`
}

// setPayload is what a SET signs. Its fields are in the order of
// canonical JSON (RFC 8785: keys sorted, no white space), which
// json.Marshal gives as long as its strings need no escapes: Body is
// base64 and LogID hex.
type setPayload struct {
	Body           string `json:"body"` // base64 of the entry's JSON
	IntegratedTime int64  `json:"integratedTime"`
	LogID          string `json:"logID"`
	LogIndex       int64  `json:"logIndex"`
}

// hashedRekord is a Rekor entry of kind hashedrekord, version 0.0.1: a
// signature of a hash by a public key or certificate.
type hashedRekord struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Spec       struct {
		Data struct {
			Hash struct {
				Algorithm string `json:"algorithm"`
				Value     string `json:"value"`
			} `json:"hash"`
		} `json:"data"`
		Signature struct {
			Content   []byte `json:"content"`
			PublicKey struct {
				Content []byte `json:"content"` // PEM
			} `json:"publicKey"`
		} `json:"signature"`
	} `json:"spec"`
}

// verifySET checks that bundle proves a Rekor log, one of keys, logged
// sig, the raw signature of payload made with signer (the DER of the
// certificate or public key that verifies sig). It returns the time the
// entry was logged.
func verifySET(keys []RekorKey, bundle string, signer, sig, payload []byte) (time.Time, error) {
	if bundle == "" {
		return time.Time{}, fmt.Errorf("no Rekor bundle: the signature has no %s annotation, the policy requires one", BundleAnnotation)
	}
	p, err := verifySETSignature(keys, bundle)
	if err != nil {
		return time.Time{}, err
	}
	// Only now is the entry trusted enough to be parsed.
	body, err := base64.StdEncoding.DecodeString(p.Body)
	if err != nil {
		return time.Time{}, fmt.Errorf("bad Rekor entry: not base64: %v", err)
	}
	if err := matchEntry(body, signer, sig, payload); err != nil {
		return time.Time{}, err
	}
	return time.Unix(p.IntegratedTime, 0), nil
}

// verifySETSignature parses bundle and verifies its SET with the key of
// the log it names.
func verifySETSignature(keys []RekorKey, bundle string) (*setPayload, error) {
	var b rekorBundle
	if err := strictJSON([]byte(bundle), &b); err != nil {
		return nil, fmt.Errorf("bad Rekor bundle: %v", err)
	}
	if len(b.SignedEntryTimestamp) == 0 || b.Payload == nil {
		return nil, errors.New("bad Rekor bundle: no SignedEntryTimestamp or no Payload")
	}
	var raw struct {
		Body           *string `json:"body"`
		IntegratedTime *int64  `json:"integratedTime"`
		LogIndex       *int64  `json:"logIndex"`
		LogID          *string `json:"logID"`
	}
	if err := strictJSON(b.Payload, &raw); err != nil {
		return nil, fmt.Errorf("bad Rekor bundle payload: %v", err)
	}
	if raw.Body == nil || raw.IntegratedTime == nil || raw.LogIndex == nil || raw.LogID == nil {
		return nil, errors.New("bad Rekor bundle payload: body, integratedTime, logIndex or logID missing")
	}
	p := &setPayload{Body: *raw.Body, IntegratedTime: *raw.IntegratedTime, LogID: *raw.LogID, LogIndex: *raw.LogIndex}
	if _, err := base64.StdEncoding.DecodeString(p.Body); err != nil {
		return nil, fmt.Errorf("bad Rekor bundle payload: body not base64: %v", err)
	}
	var key *RekorKey
	names := make([]string, len(keys))
	for i := range keys {
		names[i] = keys[i].Name
		if key == nil && keys[i].LogID == p.LogID {
			key = &keys[i]
		}
	}
	if key == nil {
		return nil, fmt.Errorf("the Rekor SET is of another log: its logID %q is not the ID of a Rekor key of the policy (%s)", p.LogID, strings.Join(names, ", "))
	}
	canonical, err := json.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("bad Rekor bundle payload: %v", err)
	}
	digest := sha256.Sum256(canonical)
	if !ecdsa.VerifyASN1(key.Key, digest[:], b.SignedEntryTimestamp) {
		return nil, fmt.Errorf("the Rekor SET does not verify with the Rekor key %s", key.Name)
	}
	return p, nil
}

// matchEntry checks that body, a Rekor entry, logs sig: the signature of
// payload by signer (DER).
func matchEntry(body, signer, sig, payload []byte) error {
	var e hashedRekord
	if err := json.Unmarshal(body, &e); err != nil {
		return fmt.Errorf("bad Rekor entry: %v", err)
	}
	if e.Kind != "hashedrekord" || e.APIVersion != "0.0.1" {
		return fmt.Errorf("the Rekor entry is of kind %q version %q, want hashedrekord 0.0.1", e.Kind, e.APIVersion)
	}
	block, rest := pem.Decode(e.Spec.Signature.PublicKey.Content)
	if block == nil || len(bytes.TrimSpace(rest)) != 0 {
		return errors.New("bad Rekor entry: its public key is not one PEM block")
	}
	// As containers/image does, the PEM's type and headers are not
	// compared: a certificate and its key never share a DER.
	if !bytes.Equal(block.Bytes, signer) {
		return errors.New("the Rekor entry is for another certificate or public key than the signature's")
	}
	if !bytes.Equal(e.Spec.Signature.Content, sig) {
		return errors.New("the Rekor entry is for another signature")
	}
	if a := e.Spec.Data.Hash.Algorithm; a != "sha256" {
		return fmt.Errorf("the Rekor entry hashes with %q, want sha256", a)
	}
	want := sha256.Sum256(payload)
	if got, err := hex.DecodeString(e.Spec.Data.Hash.Value); err != nil || !bytes.Equal(got, want[:]) {
		return errors.New("the Rekor entry is for another payload")
	}
	return nil
}

// strictJSON decodes one JSON value into v, refusing unknown fields and
// trailing data.
func strictJSON(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}
